"""A mutation campaign: generated changes to vLLM's code on kvmetrics' counted path.

:mod:`.generator` parses each vLLM module kvmetrics hooks or fingerprints and writes
mutants of the functions on the counted path; :mod:`.worker` runs one fault workload
on a mutated vLLM, without and with kvmetrics, and collects vLLM's own figures next to
kvmetrics'; :mod:`.campaign` classifies each mutant (CORRECT, FLAGGED, SILENT, CRASH,
INVALID) and prints the table. ``python -m kvmetrics.lab.vllm.mutations``
runs a campaign. Lab code: nothing shipped imports it.
"""
