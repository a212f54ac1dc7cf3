"""The serving engine: requests, scheduler, runner, sampler, offline API."""
