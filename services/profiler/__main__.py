from services.profiler.service import add_arguments, start
from shared.runner import service_main

service_main("profiler", start, add_arguments)
