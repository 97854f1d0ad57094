"""ling2.checkpoint: Ling2's own checkpoint formats (trainer step directories and state directories),
their readers and writers, and loading a state into a model. Below both the trainer and the converter."""
