"""`eyas doctor`: static, target-aware and dynamic contract checks of a drafter checkpoint.

findings.py (ids, severities, the report), reading.py (the file as written; what each engine
loads comes from eyas.formats.engines, the exporters' own tables), static.py (checkpoint alone),
with_target.py (sizes, embedding, aux ids, which architectures capture aux states: the installed
vLLM when there is one), dynamic.py (step-0 accuracy and acceptance per engine reading, cause
location, vocabulary comparison, flag recommendations).

Checked against the real engine outside the package: bench/doctor_faults.py (the broken exports
the doctor must catch), bench/doctor_agreement.py (the two verdicts compared; what vLLM does with
an export comes from eyas.serve.vllm_serve.serve_series), run by bench/doctor_vs_vllm.py and
tests/doctor/test_doctor_vllm.py.
"""
