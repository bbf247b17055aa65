"""Pass-cost benchmarks and the models they (and the tests) run on."""
