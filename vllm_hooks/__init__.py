"""Everything that touches vLLM: the general-plugin entry point (``plugin.register``), the scheduler subclass
(``scheduler.auto``) and the SchedulerOutput → Step adapter (``adapter``). Importing this package does not
import vLLM; its modules do, lazily where they can."""
