"""Where samples come from: the sampling engine and the samplers over it (in-process or a server), tasks
and data, reward functions, trajectories."""
