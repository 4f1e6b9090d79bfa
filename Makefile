# The two commands: `make demo` and `make test`. Everything else is a helper for them.
SHELL := /bin/bash
export SCD_MODEL_DIR ?= $(CURDIR)/.cache/models
export SCD_DATA_DIR ?= $(CURDIR)/.cache/data

.PHONY: demo test setup model data build lint fmt bench

setup:
	ops/setup.sh

model:
	ops/fetch-model.sh

data:
	ops/fetch-corpora.sh

build: setup
	cargo build --release

demo: setup model build
	@echo "== the base model =="
	target/release/scd generate --model $(SCD_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf \
		--prompt "In one sentence, what is a cache?" --max-tokens 48
	@echo "== the melville expert (base + LoRA trained on Moby Dick), same base weights =="
	target/release/scd generate --model $(SCD_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf \
		--adapter experts/melville/adapter.safetensors \
		--prompt "Describe the sea in two sentences." --max-tokens 48

test: setup model data
	cargo test --workspace --all-targets --no-fail-fast

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

fmt:
	cargo fmt --all
