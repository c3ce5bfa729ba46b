import sys

from hippo.cli.main import main

sys.exit(main())
