"""Actor -> engine weight resharding and in-place updates."""
