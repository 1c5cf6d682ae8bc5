"""The project's own small demo VLM: synthetic scenes, training, assembly from SmolLM2."""
