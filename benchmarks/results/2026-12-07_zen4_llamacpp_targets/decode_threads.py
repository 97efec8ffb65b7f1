import sys, time
path, engine = sys.argv[1], sys.argv[2]
p = list(range(1000, 1128))
if engine == "llamacpp":
    import llama_cpp
    llm = llama_cpp.Llama(model_path=path, n_threads=1, n_threads_batch=1, n_ctx=1024, verbose=False)
    for it in range(3):
        llm.reset(); times = []
        for _ in llm.generate([t + it for t in p], temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) == 32: break
        print(engine, "1 thread decode", round(31 / (times[-1] - times[0]), 2), flush=True)
else:
    import torch
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine_args import EngineArgs
    from tokenmill.entrypoints.bench.latency import tokenmill_run
    e = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", quantization="int4", max_model_len=1024,
                                              kv_cache_memory=80 * 2**20, enable_prefix_caching=False))
    torch.set_num_threads(1)
    run = tokenmill_run(e, 32, False)
    for it in range(3):
        print(engine, "1 thread decode", round(run([t + it for t in p])["decode_tokens_per_s"], 2), flush=True)
    e.shutdown()
