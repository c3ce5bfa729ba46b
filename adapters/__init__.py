"""Backbone adapters shipped with hippo (installed as `hippo.adapters`)."""
