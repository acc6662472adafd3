"""A minimal Facedancer device, as Facedancer's documentation writes one: a vendor IN and OUT
request, and a bulk IN and OUT endpoint (what is written comes back). Runs on any backend."""

from facedancer import *  # noqa: F403
from facedancer import main


@use_inner_classes_automatically
class MyDevice(USBDevice):
    product_string: str = "Example USB Device"
    manufacturer_string: str = "Facedancer"
    vendor_id: int = 0x1209
    product_id: int = 0x0010

    class MyConfiguration(USBConfiguration):
        class MyInterface(USBInterface):
            class MyInEndpoint(USBEndpoint):
                number: int = 1
                direction: USBDirection = USBDirection.IN
                max_packet_size: int = 64

                def handle_data_requested(self):
                    written = self.get_device().written
                    if written:
                        self.send(written.pop(0))

            class MyOutEndpoint(USBEndpoint):
                number: int = 1
                direction: USBDirection = USBDirection.OUT
                max_packet_size: int = 64

                def handle_data_received(self, data):
                    self.get_device().written.append(bytes(data))

    def __post_init__(self):
        super().__post_init__()
        self.written = []
        self.last_request = b""

    @vendor_request_handler(number=1, direction=USBDirection.IN)
    @to_device
    def my_in_vendor_request_handler(self, request):
        request.reply(b"device sent response: " + self.last_request)

    @vendor_request_handler(number=2, direction=USBDirection.OUT)
    @to_device
    def my_out_vendor_request_handler(self, request):
        self.last_request = bytes(request.data)
        request.ack()


main(MyDevice)
