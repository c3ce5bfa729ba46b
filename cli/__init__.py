"""The `hippo` command line (`main`), its video commands, and `hippo demo`.

Front end only: it sits on top of the core (`hippo`), the plugins, the adapters and `hippo_media`,
and ships what its commands need at run time: the demo's trained pair (`hippo_cli.pair`) and the
`--timeline` chart (`hippo_cli.timeline`). It never imports `hippo_benchmarks`; commands that other
packages add (`hippo bench` from `hippo_benchmarks`) are found through the `hippo.commands`
entry-point group.
"""
