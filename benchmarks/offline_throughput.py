"""Offline throughput next to HF generate_batch: the same as `engine bench throughput` (engine/bench_throughput.py).

    PYTHONPATH=. python benchmarks/offline_throughput.py --device cuda --model llama-3-8b --load-format dummy \
        --num-requests 1000 --input-len 256,768 --output-len 128,384 --hf-requests 300 --output offline.json
"""

from engine.bench_throughput import main

if __name__ == "__main__":
    main()
