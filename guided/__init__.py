"""Guided decoding: constraints on a request's output, compiled for the gpu worker.

`spec` is what a frontend validated a request's constraint into; compiling turns a spec into
a `proto.guided_messages.GuidedTable` (a token automaton the gpu worker steps on the device) or a
`proto.guided_messages.GuidedGrammar` (matched on the worker's host). Torch-free: the frontend
imports it.
"""
