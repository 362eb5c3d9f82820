"""The offline Python API (`from tandem_serve import LLM, SamplingParams`) and
`tandem run-batch`: the engine's processes driven from the caller's own process, no server."""
