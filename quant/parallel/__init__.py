"""Many ranks, one code path: the process group and tensors handed between ranks."""
