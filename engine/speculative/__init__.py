"""Speculative decoding: proposers of draft tokens, the settings, and the rule that accepts them.

A decode step with drafts is a verify step (graphs/step_runner.py StepKind.VERIFY): each request runs its
last token and its k drafts, every position samples, and the longest prefix of drafts that matches what the
target model sampled is kept, plus the token sampled after it.
"""
