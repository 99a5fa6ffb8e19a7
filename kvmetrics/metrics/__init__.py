"""Engine-agnostic core: the metric catalogue, step events, the guard and the pipeline."""
