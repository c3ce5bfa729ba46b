"""Backbone adapters shipped with hippo (installed as `hippo_adapters`)."""
