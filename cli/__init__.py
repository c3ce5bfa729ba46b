"""The `hippo` command line (`main`), its video commands, and `hippo demo`.

Front end only: it sits on top of the core (`hippo`), the plugins, the adapters and `hippo.media`.
Commands that other packages add (`hippo bench` from `hippo.benchmarks`) are found through the
`hippo.commands` entry-point group.
"""
