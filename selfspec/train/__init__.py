"""Training draft heads on a frozen target: run settings, data and features, objectives, the loop."""
