"""Predicting a training step on clusters that are not here: compute profiles, links, timelines."""
