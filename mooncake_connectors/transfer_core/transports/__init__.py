"""Transports: one module each, found through the mooncake_connectors.transports entry points."""
