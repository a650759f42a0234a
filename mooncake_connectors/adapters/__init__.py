"""adapters subpackage."""
