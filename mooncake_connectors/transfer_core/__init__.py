"""transfer_core subpackage."""
