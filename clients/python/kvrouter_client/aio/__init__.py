"""kvrouter_client.aio: the Router and the Publisher on grpc.aio, for asyncio code.

They react to the router as kvrouter_client.Router and kvrouter_client.Publisher do (the same
checks, retries, reconnects, dumps and numbering: the code deciding them is shared), with
coroutines in place of blocking calls and of the publisher's threads:

    async with Router("127.0.0.1:50051") as router:
        async with router.route(prompt, "llama") as booking:   # freed on exit, also on error or cancel
            ...
    async with Publisher(hello, ["10.0.0.5:50051", "10.0.0.6:50051"], dump=dump) as pub:
        await pub.publish(events.stored(blocks))
        await pub.flush()

Both must be made, used and closed on one running event loop. Targets are addresses or open
grpc.aio.Channel objects.
"""

from kvrouter_client.aio.publisher import Publisher
from kvrouter_client.aio.router import Booking, Router

__all__ = ["Booking", "Publisher", "Router"]
