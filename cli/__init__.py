"""The `hippo` command line (`main`), its video commands, and `hippo demo`.

Front end only: it sits on top of the core (`hippo`), the plugins, the adapters and `hippo.media`,
and ships what its commands need at run time: the demo's trained pair (`hippo.cli.pair`) and the
`--timeline` chart (`hippo.cli.timeline`). It never imports `hippo.benchmarks`; commands that other
packages add (`hippo bench` from `hippo.benchmarks`) are found through the `hippo.commands`
entry-point group.
"""
