"""Sample data for the demo, the tests and the benchmarks, apart from the packers: SA-1B-shaped
archives (`sa1b`, images and masks rendered from scikit-image's bundled photographs by `photos`),
VQA records (`vqa`), synthetic datasets of any size (`synthetic`), a local S3-compatible server
(`locals3`) and GCS emulator (`localgcs`), and `make demo` itself (`demo`). Entry points:
`python -m shard_tools.samples.sa1b`, `python -m shard_tools.samples.demo`."""
