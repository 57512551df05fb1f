"""Where samples come from: samplers (in-process or a server), tasks and data, reward functions, trajectories."""
