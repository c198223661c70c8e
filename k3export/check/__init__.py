"""`k3export check`: an artifact against the eager model (the driver, the comparison, the runners)."""
