"""Pure quantization math, batched over experts: grids, RTN, GPTQ, AWQ. No modules, hooks, devices or I/O."""
