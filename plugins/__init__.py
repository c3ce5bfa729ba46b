"""hippo's built-in plugins (installed as `hippo.plugins`).

Each module registers itself through the `hippo` entry-point group, exactly as a third-party
plugin package would.
"""
