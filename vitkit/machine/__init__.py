"""This machine, measured: what the CPU is and may run (`cpu`), which device to use (`device`), the fastest float32
GEMM path per shape and the layers that run on it (`gemm`, `fast_linear`), the precision a model runs in
(`precision`: bf16 only where measured faster) and the inference engine (`engine`: eager, ONNX Runtime or OpenVINO,
measured per model and batch; `engine_probe` times an exported engine in a child process) and how many threads torch
runs beside other processes (`threads`). Each choice is measured once and cached per machine (`vitkit.cache`; the
engine and the GEMM path only where no other process used the CPU meanwhile). Nothing here imports the models: they
are handed in."""
