"""The embedded default policy, made offline by code (no hub downloads)."""
