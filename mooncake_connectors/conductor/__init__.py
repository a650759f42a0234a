"""conductor subpackage."""
