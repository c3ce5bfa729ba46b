"""The `hippo` command line (`main`), its video commands, and `hippo demo`.

Front end only: it sits on top of the core (`hippo`), the plugins, the adapters and `hippo_media`.
Commands that other packages add (`hippo bench` from `hippo_benchmarks`) are found through the
`hippo.commands` entry-point group.
"""
