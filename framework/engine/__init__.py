"""Engine front ends and the engine core loop."""
