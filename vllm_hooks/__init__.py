"""Everything that touches vLLM: the general-plugin entry point (``plugin.register``), the scheduler subclass
(``scheduler.auto``), the SchedulerOutput → Step adapter and the budget write-back (``adapter``), and the
sinks the environment asks for, built for each monitor (``sinks``: trace, Prometheus, MQTT). Importing this
package does not import vLLM; its modules do, lazily where they can."""
