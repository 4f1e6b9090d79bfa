# The two commands: `make demo` and `make test`. Everything else is a helper for them.
SHELL := /bin/bash
export SCD_MODEL_DIR ?= $(CURDIR)/.cache/models
export SCD_DATA_DIR ?= $(CURDIR)/.cache/data

.PHONY: demo test test-amx setup model data build lint fmt bench

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
	@echo "== the cluster: a producer node and a node with the mail-rope expert (mail, its own RoPE base: raw KV breaks) in one process, every transfer mode =="
	target/release/scd demo --model $(SCD_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf \
		--expert mail-rope --prompt-file ops/demo-mail.txt --max-tokens 48 \
		--document-files ops/demo-documents/maintenance.txt,ops/demo-documents/contacts.txt \
		--question-file ops/demo-documents/question.txt

# The fuzz crate is its own workspace (see its Cargo.toml): checking it is what keeps it from
# rotting; building it would compile every dependency again without optimisation.
test: setup model data
	cargo test --workspace --all-targets --no-fail-fast
	@if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then $(MAKE) --no-print-directory test-amx; \
	else echo "AMX tests not run: this CPU has no AMX (the prefill runs on f32 here)"; fi
	cargo check --manifest-path transport/fuzz/Cargo.toml
	$(MAKE) --no-print-directory test-deploy

# The tests of the AMX prefill (`*_on_amx_tiles`, ignored by a plain `cargo test` because they
# need a CPU with AMX); `make test` runs them where the CPU has it. Elsewhere they fail, saying so.
test-amx: setup model data
	cargo test --workspace --all-targets --no-fail-fast -- --ignored on_amx_tiles

# The deployment kit, offline (docs/deploy.md): hadolint on the Dockerfile, the compose file
# against the Compose Specification's schema, every ops/k8s overlay rendered by kubectl
# kustomize and validated against Kubernetes' schemas and the vendored CRD schemas, the
# dashboard and scrape configs (ops/validate-deploy.py; a few seconds). The node side of the
# kit (the probes, the dashboard's series in live scrapes, the k8s node configs) is
# actors/tests/deploy.rs, part of `cargo test`.
.PHONY: test-deploy
test-deploy: setup
	.cache/openai-venv/bin/python ops/validate-deploy.py

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

fmt:
	cargo fmt --all

# llama.cpp (llama-cpp-python) in its own environment: the reference of the model-parity fixture
# and the baseline of `scd bench model`. Neither the build nor the tests need it.
export SCD_LLAMA_VENV ?= $(CURDIR)/.cache/llama-cpp
.PHONY: llama-cpp llama-parity-fixture bench-model

llama-cpp:
	ops/install-llama-cpp.sh

# Regenerates models/tests/fixtures/llama_parity.{json,bin} (models/tests/llama_parity.rs).
llama-parity-fixture: llama-cpp model
	$(SCD_LLAMA_VENV)/bin/python ops/llama-parity-fixture.py

# scd, candle-transformers' quantized llama and llama.cpp, same protocol, same run.
bench-model: model build
	target/release/scd bench model --model $(SCD_MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf \
		--llama-python $(SCD_LLAMA_VENV)/bin/python

# The transport's open-ended fuzz run (cargo-fuzz, libFuzzer with AddressSanitizer) of the
# receiver's path, the same function `cargo test` runs bounded (transport/tests/fuzz_receive.rs).
# cargo-fuzz needs nightly features; RUSTC_BOOTSTRAP=1 unlocks them on the stable toolchain.
# New inputs go to transport/fuzz/corpus (not checked in); the checked-in seeds are read only.
# A crash lands in transport/fuzz/artifacts: copy it into transport/fuzz/seeds/receive_path.
FUZZ_SECS ?= 600
.PHONY: fuzz
fuzz:
	command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	mkdir -p transport/fuzz/corpus/receive_path
	cd transport/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run receive_path \
		corpus/receive_path seeds/receive_path -- -max_total_time=$(FUZZ_SECS)
