from services.simulated.service import add_arguments, start
from shared.runner import service_main

service_main("executor", start, add_arguments)
