import sys

from hippo_cli.main import main

sys.exit(main())
