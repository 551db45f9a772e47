"""Small shared utilities (logging, plots, environment report)."""
