"""What the model does on calibration tokens: the routing profile and each MoE layer's damage."""
