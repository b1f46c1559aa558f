from services.api.service import add_arguments, start
from shared.runner import service_main

service_main("api", start, add_arguments)
