"""Sharding: recipes, the plan that cuts the model into stages, and the stage build."""
