"""Helpers shared by the engine tests."""


def run_streaming(engine, prompts, sampling):
  """Steps by hand; returns the requests and every RequestOutput, in order."""
  requests = [engine.add_request(p, sampling)[0] for p in prompts]
  outputs = []
  while engine.has_unfinished():
    outputs.extend(engine.step())
  return requests, outputs
