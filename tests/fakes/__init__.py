"""Real servers that stand in for model providers in tests and benchmarks."""
