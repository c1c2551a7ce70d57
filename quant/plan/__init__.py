"""Plans: which weight gets which scheme, what a plan costs, and which runtime serves it."""
