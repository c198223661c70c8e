"""One runner per artifact that check feeds and compares against the eager model."""
