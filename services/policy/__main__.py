from services.policy.service import add_arguments, start
from shared.runner import service_main

service_main("policy", start, add_arguments)
