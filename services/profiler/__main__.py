from services.profiler.service import add_arguments, start
from services.runner import service_main

service_main("profiler", start, add_arguments)
